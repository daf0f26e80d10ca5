from billing import views
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("billing/<str:batch>/invoice/", views.invoice, name="invoice"),
]
