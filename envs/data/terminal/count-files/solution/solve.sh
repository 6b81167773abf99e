#!/bin/bash
ls photos | wc -l > total.txt
cat total.txt
