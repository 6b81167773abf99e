#!/bin/bash
head -n 3 list.txt > top.txt
cat top.txt
