#!/bin/bash
# passes when unique.txt holds the sorted unique words
set -e
cd /work
printf 'apple\nfig\npear\n' | cmp -s - unique.txt
