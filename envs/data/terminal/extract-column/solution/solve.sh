#!/bin/bash
tail -n +2 people.csv | cut -d, -f2 > ages.txt
cat ages.txt
