#!/bin/bash
# passes when add.py prints 42
set -e
cd /work
[ "$(python3 add.py)" = 42 ]
