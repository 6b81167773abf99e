#!/bin/bash
# passes when total.txt holds the number of photos
set -e
cd /work
[ "$(tr -d ' \n' < total.txt)" = 5 ]
