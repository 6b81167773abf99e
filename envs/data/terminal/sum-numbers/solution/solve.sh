#!/bin/bash
awk '{s += $1} END {print s}' numbers.txt > sum.txt
cat sum.txt
