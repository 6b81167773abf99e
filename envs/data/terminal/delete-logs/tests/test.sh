#!/bin/bash
# passes when the .log files are gone, the others kept
set -e
cd /work
[ ! -e a.log ]
[ ! -e b.log ]
[ "$(cat keep.txt)" = keep ]
[ "$(cat notes.md)" = notes ]
