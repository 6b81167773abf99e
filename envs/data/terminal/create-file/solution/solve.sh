#!/bin/bash
echo 'Hello, world!' > hello.txt
cat hello.txt
