#!/bin/bash
sort -u words.txt > unique.txt
cat unique.txt
