#!/bin/bash
# passes when items.csv holds one comma-joined line
set -e
cd /work
[ "$(cat items.csv)" = red,green,blue ]
[ "$(wc -l < items.csv)" -le 1 ]
