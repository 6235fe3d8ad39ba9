import sys

from triton_offload.cli import main

sys.exit(main())
