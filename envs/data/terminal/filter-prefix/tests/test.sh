#!/bin/bash
# passes when a.txt holds the fruits starting with a, in order
set -e
cd /work
printf 'apple\navocado\napricot\n' | cmp -s - a.txt
