#!/bin/bash
sed -i 's/cat/dog/g' story.txt
cat story.txt
