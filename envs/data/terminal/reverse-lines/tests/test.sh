#!/bin/bash
# passes when reversed.txt holds the lines last to first
set -e
cd /work
printf 'third\nsecond\nfirst\n' | cmp -s - reversed.txt
