#!/bin/bash
paste -sd, items.txt > items.csv
cat items.csv
