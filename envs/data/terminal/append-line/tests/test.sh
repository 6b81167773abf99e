#!/bin/bash
# passes when env.sh keeps its line and ends with the new one
set -e
cd /work
printf 'export PORT=8080\nexport DEBUG=1\n' | cmp -s - env.sh
