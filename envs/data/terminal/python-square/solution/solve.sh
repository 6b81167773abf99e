#!/bin/bash
echo 'print(12 * 12)' > square.py
python3 square.py
