#!/bin/bash
tac list.txt > reversed.txt
cat reversed.txt
