#!/bin/bash
# passes when the notes keep their content under .md names
set -e
cd /work
[ "$(ls notes | tr '\n' ' ')" = "a.md b.md c.md " ]
[ "$(cat notes/a.md notes/b.md notes/c.md)" = "$(printf 'alpha\nbeta\ngamma')" ]
