#!/bin/bash
echo 'print(19 + 23)' > add.py
python3 add.py
