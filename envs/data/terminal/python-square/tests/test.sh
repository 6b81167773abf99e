#!/bin/bash
# passes when square.py prints 144
set -e
cd /work
[ "$(python3 square.py)" = 144 ]
