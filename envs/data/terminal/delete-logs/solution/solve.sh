#!/bin/bash
rm *.log
ls
