#!/bin/bash
wc -l < data.txt > count.txt
cat count.txt
