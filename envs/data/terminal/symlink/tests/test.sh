#!/bin/bash
# passes when latest is a link to v2
set -e
cd /work
[ -L latest ]
[ "$(readlink -f latest)" = /work/v2 ]
