"""parallel/pp"""
