import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # cp_scenarios / cp_launcher are helper modules here
