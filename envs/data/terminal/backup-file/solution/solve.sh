#!/bin/bash
mkdir -p backup && cp config.ini backup/
ls backup
