#!/bin/bash
grep -c ERROR log.txt > errors.txt
cat errors.txt
