#!/bin/bash
mkdir -p images && mv *.jpg images/
ls images
