#!/bin/bash
# passes when the .jpg files are in images/, the rest stays
set -e
cd /work
[ -f images/a.jpg ]
[ -f images/b.jpg ]
[ ! -e a.jpg ]
[ ! -e b.jpg ]
[ -f c.txt ]
[ ! -e images/c.txt ]
