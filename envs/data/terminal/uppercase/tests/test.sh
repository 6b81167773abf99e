#!/bin/bash
# passes when upper.txt holds the name in capitals
set -e
cd /work
[ "$(cat upper.txt)" = "ADA LOVELACE" ]
