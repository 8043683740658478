"""parallel/dp"""
