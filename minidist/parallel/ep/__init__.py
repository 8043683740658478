"""parallel/ep"""
