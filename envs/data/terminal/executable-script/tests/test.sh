#!/bin/bash
# passes when hello.sh is executable and prints hi
set -e
cd /work
[ -x hello.sh ]
[ "$(./hello.sh)" = hi ]
