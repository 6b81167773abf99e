#!/bin/bash
# passes when backup/config.ini is a copy and the original is still there
set -e
cd /work
printf '[server]\nport = 8080\n' | cmp -s - backup/config.ini
cmp -s config.ini backup/config.ini
