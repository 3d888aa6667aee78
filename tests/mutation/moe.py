"""(filled below)"""
MUTANTS = []
