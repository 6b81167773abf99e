#!/bin/bash
# passes when errors.txt holds the number of ERROR lines
set -e
cd /work
[ "$(tr -d ' \n' < errors.txt)" = 3 ]
