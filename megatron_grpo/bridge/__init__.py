"""bridge"""
