"""parallel/tp"""
