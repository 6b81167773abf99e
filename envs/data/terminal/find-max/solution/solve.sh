#!/bin/bash
sort -n numbers.txt | tail -n 1 > max.txt
cat max.txt
