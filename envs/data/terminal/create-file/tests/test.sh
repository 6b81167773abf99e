#!/bin/bash
# passes when hello.txt holds exactly the line
set -e
cd /work
printf 'Hello, world!\n' | cmp -s - hello.txt
