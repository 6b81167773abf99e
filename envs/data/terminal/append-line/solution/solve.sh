#!/bin/bash
echo 'export DEBUG=1' >> env.sh
cat env.sh
