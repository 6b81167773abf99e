#!/bin/bash
tr a-z A-Z < name.txt > upper.txt
cat upper.txt
