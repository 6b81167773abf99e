#!/bin/bash
# passes when ages.txt holds the ages, one per line
set -e
cd /work
printf '34\n27\n45\n' | cmp -s - ages.txt
