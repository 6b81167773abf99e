#!/bin/bash
grep '^a' fruits.txt > a.txt
cat a.txt
