#!/bin/bash
# passes when story.txt with every cat a dog
set -e
cd /work
printf 'the dog sat\nmy dog naps\n' | cmp -s - story.txt
