#!/bin/bash
# passes when words.txt holds the word count of text.txt
set -e
cd /work
[ "$(tr -d ' \n' < words.txt)" = 9 ]
