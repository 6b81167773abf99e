#!/bin/bash
wc -w < text.txt > words.txt
cat words.txt
