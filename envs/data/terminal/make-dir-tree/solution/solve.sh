#!/bin/bash
mkdir -p project/src project/tests project/docs
ls project
