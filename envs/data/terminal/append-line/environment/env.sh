export PORT=8080
