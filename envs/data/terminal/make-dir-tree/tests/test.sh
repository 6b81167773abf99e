#!/bin/bash
# passes when the three directories exist
set -e
cd /work
[ -d project/src ]
[ -d project/tests ]
[ -d project/docs ]
