#!/bin/bash
# passes when max.txt holds the largest number
set -e
cd /work
[ "$(tr -d ' \n' < max.txt)" = 93 ]
