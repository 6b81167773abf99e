#!/bin/bash
# passes when count.txt holds the line count of data.txt
set -e
cd /work
[ "$(tr -d ' \n' < count.txt)" = 6 ]
