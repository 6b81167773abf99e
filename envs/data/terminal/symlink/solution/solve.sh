#!/bin/bash
ln -s v2 latest
cat latest/README
