#!/bin/bash
printf '#!/bin/bash\necho hi\n' > hello.sh
chmod +x hello.sh
./hello.sh
