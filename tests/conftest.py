import os
import sys

# Make the harness importable from every test module and keep the parent light on threads.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
